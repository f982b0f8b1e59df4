"""The API's item ids: the dataset's own, translated to and from the model's dense ids.

A trained model numbers items densely (``relaygr.data.IdMap``: dense id ``i + 1`` is the
``i``-th original id); a user of the API knows the dataset's ids (MovieLens item 260 is *Star
Wars*). ``ItemCatalog`` translates at the service's edge, both ways, so that everything behind
it (validation, the cascade, the cache) sees dense ids only. An id the model never saw is
refused with the ids named (422), never mapped to another item. Titles come with the answer
where the dataset has them (MovieLens ``movies.dat`` / ``u.item``).

A model without an id map (a named size with random weights, or a table with string ids) is
served with its dense ids: ``ItemCatalog.identity``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from relaygr.data import IdMap
from relaygr.errors import ItemOutOfRangeError

# How many unknown ids an error names (the rest are counted).
_NAMED = 10


class UnknownItemError(ItemOutOfRangeError):
    """An item id the served model's catalogue does not hold; nothing was changed."""


class ItemCatalog:
    """Original (API) item id <-> dense (model) id, through the run's ``IdMap``, and titles by
    original id."""

    def __init__(self, id_map: IdMap | None, num_items: int,
                 titles: Mapping[int, str] | None = None) -> None:
        """``id_map`` of integer ids covering the model's items; None: the API speaks the
        dense ids 1..``num_items`` themselves."""
        assert id_map is None or id_map.num_items == num_items, \
            "an id map must cover the model's items"
        self.num_items = num_items
        self.titles = dict(titles or {})
        self.id_map = id_map

    @classmethod
    def identity(cls, num_items: int) -> ItemCatalog:
        return cls(None, num_items)

    @property
    def translates(self) -> bool:
        return self.id_map is not None

    def to_model(self, ids: Sequence[int]) -> list[int]:
        """Dense ids of API ids; ``UnknownItemError`` naming every id (up to ten) not held."""
        if self.id_map is None:
            return list(ids)
        dense = self.id_map.dense_ids(np.asarray(ids, dtype=np.int64)).tolist()
        unknown = [i for i, d in zip(ids, dense, strict=True) if d == 0]
        if unknown:
            named = ", ".join(str(i) for i in unknown[:_NAMED])
            more = f" and {len(unknown) - _NAMED} more" if len(unknown) > _NAMED else ""
            raise UnknownItemError(f"item ids not in the served model's catalogue: {named}{more}")
        return dense

    def to_api(self, dense: Sequence[int]) -> list[int]:
        """API ids of dense ids (each in 1..num_items)."""
        if self.id_map is None:
            return [int(d) for d in dense]
        return [int(self.id_map.items[d - 1]) for d in dense]

    def titles_of(self, api_ids: Sequence[int]) -> list[str | None] | None:
        """Titles of API ids, None for the whole list when the dataset has none."""
        if not self.titles:
            return None
        return [self.titles.get(int(i)) for i in api_ids]


def read_titles(data_dir: Path) -> dict[int, str]:
    """MovieLens titles beside a dataset's files (``movies.dat``: ``id::title::genres``;
    ``u.item``: ``id|title|...``; both Latin-1); empty when there are none."""
    folder = data_dir if data_dir.is_dir() else data_dir.parent
    for name, sep in (("movies.dat", "::"), ("u.item", "|")):
        path = folder / name
        if path.exists():
            titles = {}
            for line in path.read_text(encoding="latin-1").splitlines():
                fields = line.split(sep)
                if len(fields) >= 2 and fields[0].strip().isdigit():
                    titles[int(fields[0])] = fields[1]
            return titles
    return {}
