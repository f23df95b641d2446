"""What programs are compiled for: this process's devices (``local``), the devices of other processes that
share a mesh (``distributed``), and devices that are not here (``compile_only`` names them, ``cross_compile``
compiles for them, ``libtpu`` supplies the TPU compiler)."""
