"""The API speaks the dataset's item ids: translated both ways, unknown ids refused by name."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from relaygr.data import IdMap, load_sequences
from relaygr.server import ModelSource, ServerConfig, build_embedded
from relaygr.server.build import load_model
from relaygr.server.catalog import ItemCatalog, UnknownItemError, read_titles
from relaygr.train import Trainer
from tests.engine.helpers import flops_cost_model
from tests.server.helpers import run_with_client, system_config
from tests.tolerance import SCORE_TOL
from tests.train.helpers import TINY


def test_catalog_translates_both_ways_and_names_unknown_ids(tmp_path: Path) -> None:
    catalog = ItemCatalog(IdMap((260, 1, 3952)), 3, {260: "Star Wars (1977)"})
    assert catalog.to_model([3952, 260]) == [3, 1] and catalog.to_api([3, 1]) == [3952, 260]
    assert catalog.titles_of([260, 1]) == ["Star Wars (1977)", None]
    with pytest.raises(UnknownItemError, match=r"catalogue: 2, 7, 100, .*, 107 and 3 more"):
        catalog.to_model([1, 2, 7, *range(100, 110), 111])
    assert ItemCatalog.identity(5).to_model([5, 1]) == [5, 1]
    assert ItemCatalog.identity(5).titles_of([1]) is None
    (tmp_path / "movies.dat").write_bytes("260::Star Wars (1977)::Action\n2::Jumanji (1995)::"
                                          "Adventure\n".encode("latin-1"))
    assert read_titles(tmp_path / "ratings.dat") == {260: "Star Wars (1977)", 2: "Jumanji (1995)"}


def test_a_checkpoint_is_served_in_its_datasets_ids_with_titles(tmp_path: Path) -> None:
    # original ids 1000, 1003, ... (dense 1, 2, ...): a dense id at the API would be another item
    originals = [1000 + 3 * k for k in range(40)]
    lines = [f"{u}\t{originals[(u * 7 + s) % 40]}\t4\t{1_000_000 + 60 * s}\n"
             for u in range(1, 25) for s in range(20)]
    (tmp_path / "u.data").write_text("".join(lines))
    (tmp_path / "u.item").write_text("".join(f"{o}|Film {o}|01-Jan-1995\n" for o in originals))
    seqs = load_sequences("ml-100k", tmp_path / "u.data")
    Trainer(TINY.with_(max_epochs=1), seqs, tmp_path / "run", dataset="ml-100k",
            progress_bar=False, log=lambda _: None).fit()
    source = ModelSource(checkpoint=tmp_path / "run")       # users and ids from the run
    model = load_model(source)
    service = build_embedded(source, system_config(), ServerConfig(),
                             flops_cost_model(model.cfg))
    user = int(seqs.user_ids[0])

    async def body(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [await client.post("/v1/rank", json={"user_id": user,
                                                    "candidates": [1003, 1000, 1117]}),
                await client.post("/v1/rank", json={"user_id": user, "candidates": [1, 1003]}),
                await client.post("/v1/recommend", json={"user_id": user})]

    ranked, unknown, recommended = run_with_client(service, body)
    assert ranked.status_code == 200, ranked.text
    assert ranked.json()["candidates"] == [1003, 1000, 1117]
    assert ranked.json()["titles"] == ["Film 1003", "Film 1000", "Film 1117"]
    history = seqs.histories()
    items = next(h.items for h in history if int(h.user_id) == user)
    served = service.backend.store.get(user).items        # the newest events that fit
    assert served.tolist() == items[-len(served):].tolist()
    want = model.rank(torch.tensor([2, 1, 40]), prefix_items=torch.tensor(served))
    torch.testing.assert_close(torch.tensor(ranked.json()["scores"]), want.float(),
                               atol=SCORE_TOL, rtol=SCORE_TOL)
    assert unknown.status_code == 422 and "catalogue: 1" in unknown.json()["detail"]
    assert set(recommended.json()["candidates"]) <= set(originals)
