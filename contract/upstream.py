"""Every part of vLLM and LMCache kvscope reaches, one table per project, public or not.

Why a table: kvscope wraps and calls code it does not own, pinned to vLLM 0.32 and LMCache
0.5.6 (scripts/requirements.lock). Public interfaces (the KV-connector API, LMCache's storage
plugin API) change with notice; internals (`public=False`) can change in any release. Listing
both here, each with what kvscope needs it for, makes an upgrade a checklist:
tests/contract/test_upstream.py resolves every entry against the installed versions. What
kvscope wraps or calls by name (the tracer's instrumentor, the vLLM-CPU shims, the layout
identity) names its entry from here; the public base classes it subclasses are imported
directly where they are used, and listed here all the same.
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Surface:
    """`module`'s attribute `path` (dotted: "Class.method"), and why kvscope needs it."""

    module: str
    path: str
    public: bool
    why: str

    @property
    def owner(self) -> str:
        """The class (or module attribute) that holds the last name of `path`."""
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def resolve(self) -> Any:
        """The attribute itself (importing its module)."""
        return operator.attrgetter(self.path)(importlib.import_module(self.module))


_ASYNC_LLM = "vllm.v1.engine.async_llm"
_INPUTS = "vllm.v1.engine.input_processor"
_OUTPUTS = "vllm.v1.engine.output_processor"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# vLLM 0.32 (vllm-cpu here, vllm on a GPU host)
API_SERVER = Surface("vllm.entrypoints.openai.api_server", "run_server", True,
                     "the OpenAI server a user starts with `python -m ...` (the tests do too)")
ASYNC_LLM_ADD_REQUEST = Surface(_ASYNC_LLM, "AsyncLLM.add_request", False,
                                "the server span opens when the engine front end takes a request")
ASSIGN_REQUEST_ID = Surface(_INPUTS, "InputProcessor.assign_request_id", False,
                            "ties vLLM's internal request id to the client's X-Request-Id")
PROCESS_OUTPUTS = Surface(_OUTPUTS, "OutputProcessor.process_outputs", False,
                          "the first token and the server span's end")
ABORT_REQUESTS = Surface(_OUTPUTS, "OutputProcessor.abort_requests", False,
                         "ends the server span of an aborted request")
SCHEDULER_ADD_REQUEST = Surface(_SCHEDULER, "Scheduler.add_request", False,
                                "the queue span opens")
SCHEDULER_SCHEDULE = Surface(_SCHEDULER, "Scheduler.schedule", False,
                             "the queue span ends; each step's trace payload rides on its "
                             "KV-connector metadata")
SCHEDULER_UPDATE = Surface(_SCHEDULER, "Scheduler.update_from_output", False,
                           "prefill ends with the step that made the first token")
CONNECTOR_METADATA = Surface(_CONNECTOR_BASE, "KVConnectorMetadata", True,
                             "carries the step's trace payload (an attribute kvscope adds) from "
                             "the scheduler to the workers")
CONNECTOR_LOOKUP = Surface(_CONNECTOR_BASE, "KVConnectorBase_V1.get_num_new_matched_tokens",
                           True, "the KV lookup span (scheduler side)")
CONNECTOR_BIND = Surface(_CONNECTOR_BASE, "KVConnectorBase_V1.bind_connector_metadata", True,
                         "the worker reads the step's trace payload")
CONNECTOR_START_LOAD = Surface(_CONNECTOR_BASE, "KVConnectorBase_V1.start_load_kv", True,
                               "the KV load span (worker side, both model runners)")
CONNECTOR_WAIT_FOR_SAVE = Surface(_CONNECTOR_BASE, "KVConnectorBase_V1.wait_for_save", True,
                                  "the end of the step's forward (prefill span)")
CONNECTOR_FINISH_FORWARD = Surface(_CONNECTOR_BASE, "KVConnectorBase_V1.finish_forward", True,
                                   "the end of the step's forward where a runner calls it")
CONNECTOR_FACTORY = Surface("vllm.distributed.kv_transfer.kv_connector.factory",
                            "KVConnectorFactory.create_connector", False,
                            "the connector vLLM makes gets the connector hooks, whatever it is")
TRANSFER_GROUP = Surface("vllm.distributed.kv_transfer.kv_transfer_state",
                         "get_kv_transfer_group", False,
                         "a connector made before tracing started gets its hooks too")
HAS_TRANSFER_GROUP = Surface("vllm.distributed.kv_transfer.kv_transfer_state",
                             "has_kv_transfer_group", False, "whether that connector exists")
CPU_GEMM_DISPATCH = Surface("vllm.model_executor.layers.utils",
                            "dispatch_cpu_unquantized_gemm", False,
                            "fp32 GEMMs for bf16 layers where oneDNN has no bf16 matmul")
ONEDNN_SUPPORTED = Surface("vllm._custom_ops", "_supports_onednn", False,
                           "whether vLLM-CPU has its oneDNN matmul at all")
ONEDNN_CREATE = Surface("vllm._custom_ops", "create_onednn_mm", False,
                        "makes the fp32 matmul handler (and tells whether bf16 is possible)")
ONEDNN_MATMUL = Surface("vllm._custom_ops", "onednn_mm", False, "runs the fp32 matmul")
CPU_ATTENTION_ISA = Surface("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa", False,
                            "the CPU attention kernel's KV packing, part of a chunk's layout "
                            "identity (a chunk stored in another packing is refused)")
CURRENT_CONFIG = Surface("vllm.config", "get_current_vllm_config_or_none", False,
                         "the block size and cache dtype of the layout identity, and the block "
                         "size that turns failed tokens into failed blocks")
LMCACHE_CONNECTOR_LOAD_ERRORS = Surface(
    "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
    "LMCacheConnectorV1.get_block_ids_with_load_errors", True,
    "chunks the pipelined transfer gave up on after LMCache counted them read join the blocks "
    "vLLM's LMCache connector reports as not loaded (the connector API's own method, on the "
    "connector users name in --kv-transfer-config)")

VLLM = (API_SERVER, ASYNC_LLM_ADD_REQUEST, ASSIGN_REQUEST_ID, PROCESS_OUTPUTS, ABORT_REQUESTS,
        SCHEDULER_ADD_REQUEST, SCHEDULER_SCHEDULE, SCHEDULER_UPDATE, CONNECTOR_METADATA,
        CONNECTOR_LOOKUP, CONNECTOR_BIND, CONNECTOR_START_LOAD, CONNECTOR_WAIT_FOR_SAVE,
        CONNECTOR_FINISH_FORWARD, CONNECTOR_FACTORY, TRANSFER_GROUP, HAS_TRANSFER_GROUP,
        CPU_GEMM_DISPATCH, ONEDNN_SUPPORTED, ONEDNN_CREATE, ONEDNN_MATMUL, CPU_ATTENTION_ISA,
        CURRENT_CONFIG, LMCACHE_CONNECTOR_LOAD_ERRORS)

_ENGINE = "lmcache.v1.cache_engine"
_LOCAL_DISK = "lmcache.v1.storage_backend.local_disk_backend"
_STORAGE = "lmcache.v1.storage_backend.storage_manager"

# LMCache 0.5.6
STORAGE_PLUGIN = Surface("lmcache.v1.storage_backend.abstract_backend",
                         "StoragePluginInterface", True, "the disk tier is a storage plugin")
GPU_CONNECTOR = Surface("lmcache.v1.gpu_connector.gpu_connectors", "GPUConnectorInterface",
                        True, "the CPU KV connector for vLLM-CPU implements it")
CREATE_GPU_CONNECTOR = Surface("lmcache.v1.gpu_connector", "CreateGPUConnector", False,
                               "wrapped so that vLLM-CPU gets the CPU KV connector where "
                               "LMCache has none")
DEVICE_TYPE = Surface("lmcache", "torch_device_type", False,
                      "whether LMCache runs on CPU (then the CPU KV connector is needed)")
ENGINE_TYPE = Surface("lmcache.utils", "EngineType", True, "the connector is for vLLM")
PARSE_CACHE_KEY = Surface("lmcache.utils", "parse_cache_key", True,
                          "chunk keys back from their file names at start-up")
MEMORY_FORMAT = Surface("lmcache.v1.memory_management", "MemoryFormat", True,
                        "the memory objects the disk tier fills")
LMCACHE_LOGGER = Surface("lmcache.logging", "init_logger", True,
                         "the disk tier logs under LMCache's logger")
ENGINE_STORE = Surface(_ENGINE, "LMCacheEngine.store", True, "the KV store span")
ENGINE_RETRIEVE = Surface(_ENGINE, "LMCacheEngine.retrieve", True,
                          "the KV load span and its transfer; the pipelined transfer's scope "
                          "(only its gets hand chunks out before they are verified)")
TO_DEVICE = Surface("lmcache.v1.gpu_connector.gpu_connectors",
                    "GPUConnectorInterface.batched_to_gpu", True,
                    "the transfer span (wrapped on the class of the engine's connector)")
ENGINE_LOOKUP = Surface(_ENGINE, "LMCacheEngine.lookup", True,
                        "the chunk ledger: which chunks a lookup asked for")
STORAGE_CONTAINS = Surface(_STORAGE, "StorageManager.batched_contains", False,
                           "the chunk ledger: which tier answered each chunk")
STORAGE_PUT = Surface(_STORAGE, "StorageManager.batched_put", False,
                      "the chunk ledger: which chunks were stored")
CPU_REMOVE = Surface("lmcache.v1.storage_backend.local_cpu_backend", "LocalCPUBackend.remove",
                     False, "the chunk ledger: chunks evicted from the CPU tier")
DISK_BATCHED_GET = Surface(_LOCAL_DISK, "LocalDiskBackend.batched_get_blocking", False,
                           "storage-read spans for LMCache's stock disk tier")
DISK_GET = Surface(_LOCAL_DISK, "LocalDiskBackend.get_blocking", False,
                   "storage-read spans for LMCache's stock disk tier")
DISK_GET_NON_BLOCKING = Surface(_LOCAL_DISK, "LocalDiskBackend.batched_get_non_blocking", False,
                                "storage-read spans for the stock tier's prefetch")
DISK_READ_FILE = Surface(_LOCAL_DISK, "LocalDiskBackend.read_file", False,
                         "the stock tier's reader threads, for the block-I/O join")

_RAW_BLOCK = "lmcache.v1.storage_backend.plugins.rust_raw_block_backend"
_REMOTE = "lmcache.v1.storage_backend.remote_backend"
RAW_BLOCK_BATCHED_GET = Surface(_RAW_BLOCK, "RustRawBlockBackend.batched_get_blocking", True,
                                "storage-read spans for LMCache's raw-block tier (a plugin)")
RAW_BLOCK_GET = Surface(_RAW_BLOCK, "RustRawBlockBackend.get_blocking", True,
                        "storage-read spans for LMCache's raw-block tier (a plugin)")
RAW_BLOCK_PUT = Surface(_RAW_BLOCK, "RustRawBlockBackend.batched_submit_put_task", True,
                        "the chunk ledger: the raw-block tier's writes, done or failed")
REMOTE_BATCHED_GET = Surface(_REMOTE, "RemoteBackend.batched_get_blocking", False,
                             "storage-read spans for LMCache's fs connector")
REMOTE_GET = Surface(_REMOTE, "RemoteBackend.get_blocking", False,
                     "storage-read spans for LMCache's fs connector")
REMOTE_PUT = Surface(_REMOTE, "RemoteBackend.batched_submit_put_task", False,
                     "the chunk ledger: the fs connector's writes")
FS_READ = Surface("lmcache.v1.storage_backend.connector.fs_connector",
                  "FSConnector._get_with_odirect", False,
                  "the fs connector's reader threads (its O_DIRECT read), for the block-I/O join")

LMCACHE = (STORAGE_PLUGIN, GPU_CONNECTOR, CREATE_GPU_CONNECTOR, DEVICE_TYPE, ENGINE_TYPE,
           PARSE_CACHE_KEY, MEMORY_FORMAT, LMCACHE_LOGGER, ENGINE_STORE, ENGINE_RETRIEVE,
           TO_DEVICE, ENGINE_LOOKUP, STORAGE_CONTAINS, STORAGE_PUT, CPU_REMOVE, DISK_BATCHED_GET, DISK_GET,
           DISK_GET_NON_BLOCKING, DISK_READ_FILE, RAW_BLOCK_BATCHED_GET, RAW_BLOCK_GET,
           RAW_BLOCK_PUT, REMOTE_BATCHED_GET, REMOTE_GET, REMOTE_PUT, FS_READ)
