"""The project's one 64-bit mix is SplitMix64's finaliser, scalar and vectorised alike."""

from __future__ import annotations

import numpy as np

from relaygr.splitmix import GOLDEN_GAMMA, mix64, mix64_array


def test_mix64_is_splitmix64() -> None:
    # The first two outputs of SplitMix64 seeded with 0 (the reference generator's state advances
    # by the golden gamma and is then finalised).
    assert mix64(GOLDEN_GAMMA) == 0xE220A8397B1DCDAF
    assert mix64(2 * GOLDEN_GAMMA) == 0x6E789E6AA1B965F4
    values = np.array([0, 1, GOLDEN_GAMMA, 2**64 - 1, 123456789], dtype=np.uint64)
    assert [int(x) for x in mix64_array(values)] == [mix64(int(v)) for v in values]
