# SPDX-License-Identifier: Apache-2.0
"""Child process of the kill -9 test: queues chunk stores 0, 1, 2, ... until it is killed.

Usage: python writer_child.py KV_DIR. Prints "queued N" after each batch of 4 chunks; it never
waits for the writes, so the writer thread is busy (mid-write) whenever the kill lands.
"""

import sys

from kvscope.testkit.lmcache_harness import Harness


def main(argv: list[str]) -> int:
    h = Harness(argv[1])
    i = 0
    while True:
        h.put(list(range(i, i + 4)), flush=False)
        print(f"queued {i + 3}", flush=True)
        i += 4


if __name__ == "__main__":
    sys.exit(main(sys.argv))
