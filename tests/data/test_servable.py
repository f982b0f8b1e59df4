"""What of a dataset a trained model can serve (``data/servable.py``), on exact cases: user ids
that are integers a request can name, and a timed user's times unix seconds a request can carry,
in its sequence's order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relaygr.data import (
    MAX_TIMESTAMP_S,
    MAX_USER_ID,
    build_sequences,
    check_time_order,
    check_times,
    check_timestamp_bound,
    check_user_ids,
    read_table,
)
from relaygr.errors import ConfigError, DataError


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_string_user_ids_are_refused_naming_the_file_and_the_first_that_is_no_integer(
        tmp_path: Path) -> None:
    # one non-integer makes the reader keep the whole column as strings
    table = read_table(_csv(tmp_path / "t.csv", "user,item\n1,5\nx7,5\n2,6\nx3,6\nx7,6\n"))
    assert table.users.dtype == object
    with pytest.raises(ConfigError) as refused:
        check_user_ids(table.source, table.users)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 't.csv'} names its users by strings (2 of its 4 "
                              "user ids are not integers, the first 'x3'): ")
    assert "0..2^53-1" in message and "renumbered" in message


def test_user_ids_are_the_apis_zero_to_2_53_minus_1() -> None:
    check_user_ids("mem.csv", np.array([MAX_USER_ID, 0, 5, 0], dtype=np.int64))
    for ids, first in (([2 ** 60, 3, MAX_USER_ID + 1, 2 ** 60], MAX_USER_ID + 1),
                       ([2, -1, -4, -1], -4)):
        with pytest.raises(ConfigError) as refused:
            check_user_ids("mem.csv", np.array(ids, dtype=np.int64))
        assert str(refused.value).startswith(
            f"mem.csv has user ids outside 0..2^53-1 (2 of its 3 users, the first {first}): ")


ROWS = """user,item,timestamp,order
7,10,100,0
3,11,50,1
7,12,90,1
3,13,,0
3,14,40,2
7,15,200,2
9,16,10,0
9,17,20,1
"""


def test_a_timed_users_time_going_back_in_its_order_is_refused_at_its_line(
        tmp_path: Path) -> None:
    path = _csv(tmp_path / "t.csv", ROWS)
    seqs = build_sequences(read_table(path))
    assert seqs.timed.tolist() == [False, True, True]     # users 3, 7, 9
    assert seqs.lines.tolist() == [5, 3, 6, 2, 4, 7, 8, 9]   # each event's line, in order
    with pytest.raises(DataError) as refused:
        check_time_order(seqs)
    assert (refused.value.path, refused.value.line) == (str(path), 4)
    assert str(refused.value) == (
        f"{path}:4: user 7's event at position 1 (0-based) of its sequence, as the file orders "
        "it, has timestamp 90, before the 100 of the event before it (time goes back for 1 of "
        "the 2 timed users): a model that reads time (use_timestamps) needs each user's "
        "timestamps non-decreasing in the order of its events; correct the timestamps or the "
        "order column, or train without use_timestamps")
    # user 3 is untimed (one event has no time): its times are never read, 50 then 40 included
    check_time_order(build_sequences(read_table(
        _csv(tmp_path / "fixed.csv", ROWS.replace("7,12,90,1", "7,12,150,1")))))


def test_equal_times_and_data_sorted_by_time_pass(tmp_path: Path) -> None:
    check_time_order(build_sequences(read_table(_csv(
        tmp_path / "t.csv", "user,item,timestamp,order\n1,5,10,0\n1,6,10,1\n1,7,11,2\n"))))
    # without an order column a timed user is sorted by time: it never goes back
    check_time_order(build_sequences(read_table(_csv(
        tmp_path / "u.csv", "user,item,timestamp\n1,5,30\n1,6,10\n1,7,20\n"))))


STAMPED = """user,item,timestamp,order
4,10,1700000000,0
4,11,1700000060,1
8,12,1700000000000,0
8,13,1700000060000,1
5,14,,0
5,15,1700000000000,1
6,16,-5,0
6,17,10,1
"""


def test_a_timed_users_timestamp_past_the_apis_2_40_seconds_is_refused_as_milliseconds(
        tmp_path: Path) -> None:
    path = _csv(tmp_path / "t.csv", STAMPED)
    seqs = build_sequences(read_table(path))
    assert seqs.timed.tolist() == [True, False, True, True]     # users 4, 5, 6, 8
    with pytest.raises(DataError) as refused:
        check_timestamp_bound(seqs)
    # the first in file order, though user 6's -5 comes first in user order; user 5 is untimed
    # (one event has no time): its 1700000000000 is never read
    assert (refused.value.path, refused.value.line) == (str(path), 4)
    assert str(refused.value) == (
        f"{path}:4: user 8 has timestamp 1700000000000, outside the 0..2^40 unix seconds a "
        "request can carry (3 of the 6 events of timed users): as seconds that is past the "
        "year 36,800: most likely milliseconds (divide by 1000) or microseconds. A model that "
        "reads time (use_timestamps) needs timestamps in unix seconds; convert them, or train "
        "without use_timestamps")
    # before 1970 is outside too
    seconds = STAMPED.replace("1700000000000", "1700000000").replace("1700000060000",
                                                                     "1700000060")
    with pytest.raises(DataError, match=r"s\.csv:8: user 6 has timestamp -5, outside the 0\.\.2"
                       r"\^40 unix seconds a request can carry \(1 of the 6 events of timed "
                       r"users\): that is before 1970\. "):
        check_times(build_sequences(read_table(_csv(tmp_path / "s.csv", seconds))))


def test_the_timestamp_bound_is_2_40_inclusive_and_checked_before_the_order(
        tmp_path: Path) -> None:
    assert MAX_TIMESTAMP_S == 2 ** 40
    check_times(build_sequences(read_table(_csv(
        tmp_path / "t.csv", f"user,item,timestamp\n1,5,0\n1,6,{2 ** 40}\n"))))
    with pytest.raises(DataError, match=rf"t1\.csv:3: user 1 has timestamp {2 ** 40 + 1}, "):
        check_times(build_sequences(read_table(_csv(
            tmp_path / "t1.csv", f"user,item,timestamp\n1,5,0\n1,6,{2 ** 40 + 1}\n"))))
    # out of range and back in time: the unit is named, the likelier cause
    with pytest.raises(DataError, match=r"t2\.csv:2: user 1 has timestamp 1700000060000, "):
        check_times(build_sequences(read_table(_csv(
            tmp_path / "t2.csv",
            "user,item,timestamp,order\n1,5,1700000060000,0\n1,6,1700000000000,1\n"))))
