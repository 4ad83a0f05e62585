"""Each kernel test starts and ends with no tuning table read and no launch remembered, so a
test that patches an op's table sees its own patch (selects are memoised)."""
import pytest

from nanoserve.kernels import tuning


@pytest.fixture(autouse=True)
def fresh_selects():
    tuning.clear_caches()
    yield
    tuning.clear_caches()
