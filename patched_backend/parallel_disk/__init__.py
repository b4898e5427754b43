# SPDX-License-Identifier: Apache-2.0
"""kvscope's parallel-read LMCache disk tier, loaded as an LMCache storage plugin.

Enable it by configuration only (no patched LMCache files)::

    storage_plugins: [kvscope]
    extra_config:
      storage_plugin.kvscope.module_path: kvscope.patched_backend.parallel_disk.backend
      storage_plugin.kvscope.class_name: ParallelDiskBackend
      kvscope.path: /mnt/nvme/kv
      kvscope.capacity: 20GB

See docs/backend.md for every knob, the chunk file format and the listener hooks.
"""
