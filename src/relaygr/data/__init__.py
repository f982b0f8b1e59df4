"""Interaction data: file readers, time-ordered user sequences, dense ids, leave-one-out split.

Layers (lower never import upper): ``table`` (raw columns) <- ``readers`` (one per file format),
``fingerprint`` (a table's content, and its sequences' in their order) <- ``sequences``
(ordering, ``IdMap``) <- ``split``, ``servable`` (what of a dataset a trained model can serve)
<- ``sources`` (dataset names -> files).

Public names: ``iter_histories`` and ``load_sequences`` (a dataset directory -> per-user
histories), ``IdMap``, ``UserEvents``, ``UserSequences``, ``leave_one_out``,
``LeaveOneOutSplit``, ``EvalCases``, ``TableSpec``, the readers ``read_ratings_dat``,
``read_ml100k``, ``read_table``, ``table_fingerprint`` and ``sequence_fingerprint``, ``resolve``
/ ``DATASET_FILES``, and the checks training and serving share, ``check_user_ids``
(``MAX_USER_ID``), and for a model that reads time ``check_times`` (``check_timestamp_bound``,
``MAX_TIMESTAMP_S``, and ``check_time_order``).
"""

from relaygr.data.fingerprint import sequence_fingerprint, table_fingerprint
from relaygr.data.readers import (
    ORDERED_ML1M_SPEC,
    TableSpec,
    read_ml100k,
    read_ratings_dat,
    read_table,
)
from relaygr.data.sequences import IdMap, UserEvents, UserSequences, build_sequences
from relaygr.data.servable import (
    MAX_TIMESTAMP_S,
    MAX_USER_ID,
    check_time_order,
    check_times,
    check_timestamp_bound,
    check_user_ids,
)
from relaygr.data.sources import (
    DATASET_FILES,
    DatasetSource,
    iter_histories,
    load_sequences,
    resolve,
)
from relaygr.data.split import EvalCases, LeaveOneOutSplit, hold_out_validation_of, leave_one_out
from relaygr.data.table import InteractionTable

__all__ = ["DATASET_FILES", "MAX_TIMESTAMP_S", "MAX_USER_ID", "ORDERED_ML1M_SPEC",
           "DatasetSource", "EvalCases", "IdMap", "InteractionTable", "LeaveOneOutSplit",
           "TableSpec", "UserEvents", "UserSequences", "build_sequences", "check_time_order",
           "check_times", "check_timestamp_bound", "check_user_ids",
           "hold_out_validation_of", "iter_histories", "leave_one_out", "load_sequences",
           "read_ml100k", "read_ratings_dat", "read_table", "resolve", "sequence_fingerprint",
           "table_fingerprint"]
