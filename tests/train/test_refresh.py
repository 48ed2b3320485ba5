"""Refresh schedule, staleness bookkeeping and weight publishing (fake service)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_nce.core.config import from_dict
from dist_nce.train.config import RefreshConfig, TrainJobConfig
from dist_nce.train.plan import make_plan
from dist_nce.train.refresh import Publisher, RefreshBook, refresh_due
from tests.train.fakes import FakeService


def plan(steps_per_epoch=5):
    cfg = from_dict(TrainJobConfig, {"optim": {"batch_size": 2, "epochs": 3}, "negatives": {"num_candidates": 4}})
    return make_plan(cfg, np.arange(2 * steps_per_epoch), 100)


def due(steps, **kw):
    cfg = RefreshConfig(**kw)
    return [t for t in range(steps) if refresh_due(cfg, False, plan(), t)]


def test_schedule():
    assert due(15, mode="sync", every_steps=0, at_epoch_start=True) == [5, 10]  # the paper's mode
    assert due(15, mode="async", every_steps=4, at_epoch_start=False) == [4, 8, 12]
    assert due(15, mode="async", every_steps=4, at_epoch_start=True) == [4, 5, 8, 10, 12]
    assert due(15, mode="never", every_steps=4) == []
    assert not refresh_due(RefreshConfig(every_steps=1), True, plan(), 3)  # frozen entity encoder


def test_book_staleness_and_json():
    book = RefreshBook()
    assert book.staleness(7, 0) == 7
    book.record(1, 5)
    book.record(2, 9)
    assert (book.staleness(10, 1), book.staleness(10, 2), book.staleness(10, -1)) == (5, 1, -1)
    # a version the book did not publish (a KB delta's, on top of version 2) holds version 2's weights
    assert book.staleness(10, 3) == 1
    with pytest.raises(ValueError, match="must increase"):
        book.record(2, 11)
    assert RefreshBook.from_json(book.to_json()) == book
    book.skip_past(6)
    assert book.version == 6 and 6 not in book.publish_step


class TinyRetriever(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.entity_side = torch.nn.Linear(2, 2)

    def entity_encoder_state(self):
        return {"w": self.entity_side.weight.detach().clone()}


def test_publisher_ships_one_snapshot_per_version_from_rank_0_only():
    service, puts = FakeService(), []
    model = TinyRetriever()

    def put(obj):
        puts.append(obj)
        return ("ref", len(puts))

    pub = Publisher(service, model, RefreshBook(), rank=0, zero3=False, wait=False, put=put)
    assert pub.publish(step=3) == 1
    with torch.no_grad():
        model.entity_side.weight.add_(1.0)
    assert pub.publish(step=6) == 2
    assert [v for _, v in service.states] == [1, 2] and [r for r, _ in service.states] == [("ref", 1), ("ref", 2)]
    assert not torch.equal(puts[0]["w"], puts[1]["w"])  # a snapshot, not a view of live weights
    assert pub.book.publish_step == {0: 0, 1: 3, 2: 6}
    with pytest.raises(ValueError, match="rank > 0 needs broadcast"):
        Publisher(service, model, RefreshBook(), rank=1, zero3=False, wait=False, put=put)
    other = Publisher(service, model, RefreshBook(), rank=1, zero3=False, wait=False, put=put,
                      broadcast=lambda v: 7 if v is None else v)
    assert other.publish(step=3) == 7 and len(puts) == 2  # rank 1 books rank 0's number, ships nothing
    assert other.book.publish_step == {0: 0, 7: 3}


def test_rank_0_numbers_past_versions_it_did_not_publish_and_tells_the_others():
    """A KB delta took version 1 between two refreshes: the next refresh is numbered past it by the service,
    and rank 0 broadcasts that number, so that every rank books the same version (none computes its own)."""
    service, said = FakeService(), []
    service.states.append(("delta", 1))  # the service handed version 1 to a KB delta
    pub = Publisher(service, TinyRetriever(), RefreshBook(), 0, False, wait=False, put=lambda o: o,
                    broadcast=lambda v: said.append(v) or v)
    assert pub.publish(step=4) == 2 and said == [2] and pub.book.publish_step == {0: 0, 2: 4}
    assert pub.book.staleness(6, 1) == 6  # the delta's version holds version 0's weights


def test_a_failed_async_refresh_is_an_error_at_the_next_publish():
    """A refresh that failed in a shard (a full disk, a refusal) is done: asked only whether it was done, the
    publisher dropped it, and training went on against the old index while the published version counted up."""
    service = FakeService(instant=False)

    class Failed:
        version = 1

        def done(self) -> bool:
            return True

        def wait(self, timeout=None):
            raise OSError("No space left on device")

    service.refresh = lambda state, version=None, wait=False, after=-1: Failed()
    pub = Publisher(service, TinyRetriever(), RefreshBook(), 0, False, wait=False, put=lambda o: o)
    assert pub.publish(2) == 1  # async: nothing waited for yet
    with pytest.raises(RuntimeError, match=r"the refresh to index version 1 failed: No space left on device"):
        pub.publish(4)
    with pytest.raises(RuntimeError, match=r"index version 1 failed"):
        pub.finish()
    sync = Publisher(service, TinyRetriever(), RefreshBook(), 0, False, wait=True, put=lambda o: o)
    with pytest.raises(RuntimeError, match=r"the refresh to index version 1 failed"):
        sync.publish(2)


def test_sync_waits_and_async_waits_for_the_previous_refresh_only():
    service, barriers = FakeService(instant=False), []
    pub = Publisher(service, TinyRetriever(), RefreshBook(), 0, False, wait=False, put=lambda o: o,
                    barrier=lambda: barriers.append(1))
    pub.publish(2)
    assert pub.pending() and service.served == 0  # async: training goes on with version 0
    pub.publish(4)  # the previous refresh is waited for before the next one is shipped
    assert service.served == 1 and pub.pending()
    pub.publish(6, wait=True)
    assert service.served == 3 and not pub.pending() and barriers == [1]
