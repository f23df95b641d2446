"""Process metrics: what was compiled and served from which cache tier (``compile_stats``), and the device
memory the runtime holds, by use (``memory_accounting``). Counted where things happen, read by
``tpucompile.stats()`` and ``tpucompile.memory_stats()``; like ``contracts``, importable from anywhere."""
