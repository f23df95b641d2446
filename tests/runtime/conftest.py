import pytest

from tpucompile.runtime import get_target


@pytest.fixture(scope="module")
def target():
    """This process's CPU target, which must have the host convolution kernel."""
    found = get_target("cpu")
    assert found.host_blas is not None and found.host_blas.convolutions, (
        "the host kernels did not build or bind on this machine (they need a C compiler, $CC or cc, and "
        "torch's sgemm_; the reason is logged at INFO by logger 'tpucompile')")
    return found
