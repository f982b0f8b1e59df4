"""The HSTU ranking model and the value types of its serving API.

Public names (stable): ``HSTU``, ``HSTUConfig``, ``PrefixKV``, ``RankInput``,
``PrefillInput``, ``RankOutput``, ``CandidateStates``, ``concat_prefix``, ``config_for_size``,
``MODEL_SIZES``.
"""

from relaygr.model.config import MODEL_SIZES, HSTUConfig, config_for_size
from relaygr.model.hstu import HSTU, CandidateStates, RankOutput
from relaygr.model.inputs import PrefillInput, RankInput
from relaygr.model.kv import PrefixKV
from relaygr.model.passes import concat_prefix

__all__ = ["HSTU", "MODEL_SIZES", "CandidateStates", "HSTUConfig", "PrefillInput", "PrefixKV",
           "RankInput", "RankOutput", "concat_prefix", "config_for_size"]
