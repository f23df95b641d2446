"""Host kernels: CPU matrix products and f32 convolutions run by the host's BLAS inside XLA programs.

``library`` builds the C handlers (``kernels.c``) and registers them with XLA; ``dots`` and ``convolutions``
rewrite the ops the handlers can take into calls of them (through ``ffi_calls``); ``kernel_choice`` times
each such op both ways on this machine and keeps the host kernel only where it wins.
"""
