"""Dumps of what each compiled graph became: ``tpucompile dump-hlo`` and ``TPUCOMPILE_DUMP_DIR``.

While a dump is active, every graph the backend compiles gets a folder ``DIR/NNN-ROLE`` (numbered in compile
order; ROLE is forward, backward or inference, followed by the region for a partitioned graph) holding:

    fx.txt                     Dynamo's FX graph, as the backend received it
    fx_rewrite_attention.txt   the same after attention was routed to its math form (when it was)
    fx_rewrite_interpolation.txt  the same after bilinear resampling became matrix products (when it did)
    aten_N_<stage>.txt         the ATen graph from AOTAutograd, then after each pass
    aten.txt                   the ATen graph that was lowered
    locations.txt              each ATen op and the user's source line it came from
    stablehlo.mlir             StableHLO text; each op carries loc("file.py":line:col) of the user's source
    stablehlo.mlirbc           the same as a portable StableHLO artifact (versioned VHLO bytecode; MLIR
                               bytecode for sharded programs, which the portable format cannot hold)
    hlo.txt                    XLA HLO as XLA's passes first see it
    hlo_optimized.txt          XLA HLO of the compiled executable, after optimisation
    compile_options.txt        the XLA compile options
    key.json                   the executable's cache key and its components
    info.json                  op counts, signature, compile time, cache outcome, fallback ops, source files
    targets/<target>/          per compile-only target (``--target tpu:v5e:2x2``): the StableHLO it was
                               lowered to, its optimised HLO, compile options, key and report.json (memory
                               per chip by use, flops, whether it fits, or why it does not compile)

The package has one module per concern, so that what runs inside a compile stays apart from what only reads:

    layout          the dump's folder and file names, shared by the writer and the readers
    recorder        writes the dump, in the compiling process (``start``/``stop``, ``TPUCOMPILE_DUMP_DIR``)
    reader          reads a dump back: every graph's ``info.json``, one stage of one graph
    report          the summary tables printed after a dump (and kept in its ``summary.txt``)
    programs        the StableHLO stored under a cache key or dumped for one, and a diff of two
    stablehlo_text  prints a StableHLO module, with source locations or without

Recording happens through ``driver.set_graph_recorder`` and ``driver.add_observer``; it never fails a compile
(a stage that cannot be written is named in ``info.json``). Reading a dump (the summary table, one stage of
one graph, the StableHLO of a cache entry) imports neither torch nor the compiler, so the command line
answers quickly.
"""
