"""The rank pools live while this package's tests run and stop when they are done."""

import pytest

from tests.distributed.harness import close_pools


@pytest.fixture(scope="package", autouse=True)
def _rank_pools_end_with_the_package():
    yield
    close_pools()
