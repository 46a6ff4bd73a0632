"""Migrator core: configuration, the directive book and the agreement rule, state encoding and transfer."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foreshock.migrator import (Directive, DirectiveBook, DirectiveKind, MigratorConfig, MigratorConfigError)
from foreshock.migrator.directives import CONTROL_SIZE, MAX_EXACT_WORLD

from pathlib import Path
from support import free_port

REPO = Path(__file__).resolve().parents[1]


def test_import_needs_no_torch():
    code = ("import sys, foreshock.migrator, foreshock.migrator.client; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_documented_loop_runs():
    """docs/migrator.md's example, as written, on a one-rank world hosting its own store."""
    import re
    pytest.importorskip("torch")
    doc = (REPO / "docs" / "migrator.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1).replace("10_000", "20")
    prelude = ("import torch\n"
               "def load_batch(step, rank, world):\n"
               "    g = torch.Generator().manual_seed(step * 10 + rank)\n"
               "    return torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)\n")
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "FORESHOCK_JOB_ID": "doc", "RANK": "0", "WORLD_SIZE": "1",
           "FORESHOCK_STORE": f"127.0.0.1:{port}", "FORESHOCK_HOST_STORE": "1"}
    out = subprocess.run([sys.executable, "-c", prelude + code + "\nprint('steps', mig.step, position.next_step)"],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["steps", "20", "20"]


def test_config_from_env_with_torchrun_fallbacks():
    env = {"FORESHOCK_JOB_ID": "llama", "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "FORESHOCK_NODE": "node-07", "FORESHOCK_SPARE_NODES": "node-08, node-09",
           "FORESHOCK_SERVICE": "127.0.0.1:50051", "FORESHOCK_TOKEN": "s3cret", "FORESHOCK_FALLBACK": "checkpoint_exit"}
    c = MigratorConfig.from_env(env)
    assert (c.job_id, c.rank, c.world_size, c.node, c.store) == ("llama", 3, 4, "node-07", "10.0.0.1:29500")
    assert c.spare_nodes == ("node-08", "node-09") and c.fallback == "checkpoint_exit" and c.token == "s3cret"
    # FORESHOCK_* wins over torchrun's, an argument wins over both
    c = MigratorConfig.from_env({**env, "FORESHOCK_RANK": "1"}, world_size=8)
    assert (c.rank, c.world_size) == (1, 8)
    # under torchrun alone: the job id is its run id (--rdzv-id), the store its rendezvous store
    torchrun = {"TORCHELASTIC_RUN_ID": "run-42", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                "MASTER_PORT": "29400"}
    c = MigratorConfig.from_env(torchrun)
    assert (c.job_id, c.store) == ("run-42", "h:29400")
    assert MigratorConfig.from_env({**torchrun, "FORESHOCK_JOB_ID": "mine"}).job_id == "mine"


@pytest.mark.parametrize("env, names", [
    ({"RANK": "0", "WORLD_SIZE": "2", "FORESHOCK_STORE": "h:1"}, "FORESHOCK_JOB_ID"),
    ({"FORESHOCK_JOB_ID": "j", "RANK": "x", "WORLD_SIZE": "2", "FORESHOCK_STORE": "h:1"}, "RANK"),
    ({"FORESHOCK_JOB_ID": "j", "RANK": "2", "WORLD_SIZE": "2", "FORESHOCK_STORE": "h:1"}, "FORESHOCK_WORLD_SIZE"),
    ({"FORESHOCK_JOB_ID": "j", "RANK": "0", "WORLD_SIZE": "2"}, "FORESHOCK_STORE"),
    ({"FORESHOCK_JOB_ID": "j", "RANK": "0", "WORLD_SIZE": "2", "FORESHOCK_STORE": "h:1",
      "FORESHOCK_FALLBACK": "pray"}, "FORESHOCK_FALLBACK"),
    ({"FORESHOCK_JOB_ID": "j", "RANK": "0", "WORLD_SIZE": "2", "FORESHOCK_STORE": "h:1",
      "FORESHOCK_SERVICE": "nohost"}, "FORESHOCK_SERVICE"),
])
def test_config_errors_name_the_variable(env, names):
    with pytest.raises(MigratorConfigError, match=names):
        MigratorConfig.from_env(env)


def test_spare_needs_no_rank():
    c = MigratorConfig.from_env({"FORESHOCK_JOB_ID": "j", "FORESHOCK_ROLE": "spare", "FORESHOCK_STORE": "h:1",
                                 "FORESHOCK_NODE": "spare-0"})
    assert c.role == "spare" and c.rank == -1


def _d(i: str, at: int = 10, ranks=(1,), cancelled=False) -> Directive:
    return Directive(i, DirectiveKind.EVACUATE, tuple(ranks), "n1", "n9", at_step=at, cancelled=cancelled)


def test_book_acts_once_on_a_directive_delivered_many_times():
    book = DirectiveBook()
    assert book.offer(_d("a"))
    assert not book.offer(_d("a"))             # re-delivered while pending: nothing changes
    assert book.candidate().directive_id == "a"
    book.finish("a")
    assert not book.offer(_d("a"))             # re-delivered after it was acted on
    assert book.candidate() is None and book.redelivered == ["a"]
    # a spare inherits what was done, so it never repeats a switch either
    heir = DirectiveBook(done=book.done)
    assert not heir.offer(_d("a")) and heir.candidate() is None


def test_book_drops_directives_past_their_deadline_unless_agreed():
    book = DirectiveBook()
    late = Directive("late", DirectiveKind.EVACUATE, (1,), "a", "b", at_step=5, deadline=100.0)
    agreed = Directive("agreed", DirectiveKind.EVACUATE, (2,), "c", "d", at_step=9, deadline=100.0)
    timely = Directive("timely", DirectiveKind.EVACUATE, (3,), "e", "f", at_step=7, deadline=200.0)
    for d in (late, agreed, timely):
        book.offer(d)
    assert book.expire(99.0) == []                          # nothing is due yet
    assert book.expire(150.0, keep={"agreed"}) == [late]    # an agreed switch goes ahead
    assert book.get("late") is None and "late" in book.done
    assert not book.offer(late)                             # a redelivery is not taken again
    assert book.candidate() == timely and book.get("agreed") == agreed
    assert [d.directive_id for d in book.expire(250.0)] == ["agreed", "timely"]


def test_book_cancel_and_order():
    book = DirectiveBook()
    book.offer(_d("late", at=50))
    book.offer(_d("early", at=20))
    assert book.candidate().directive_id == "early"
    assert book.offer(_d("early", cancelled=True))
    assert book.candidate().directive_id == "late"
    ctrl, cand = book.control(next_completed_step=49)
    assert ctrl == [1.0, float(cand.key), 0.0] and len(ctrl) == CONTROL_SIZE
    assert book.control(next_completed_step=50)[0][2] == 1.0


def _agree(books, step):
    contributions = [b.control(step) for b in books]
    summed = [sum(c[0][i] for c in contributions) for i in range(CONTROL_SIZE)]
    return [DirectiveBook.decide(summed, len(books), cand) for _, cand in contributions]


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.lists(st.integers(0, 3), min_size=2, max_size=64), st.integers(0, 30))
def test_agreement_is_all_or_none(world, knows, step):
    """Whatever each rank has heard so far, every rank reaches the same decision at the same step."""
    rng = random.Random(world * 1000 + step)
    ids = ["d-a", "d-b", "d-c"]
    books = []
    for r in range(world):
        book = DirectiveBook()
        k = knows[r % len(knows)]
        for i in rng.sample(ids, k):
            book.offer(_d(i, at=rng.choice([5, 10, 20])))
        books.append(book)
    decisions = _agree(books, step)
    acted = {(d.directive_id if d else None, go) for d, go in decisions}
    assert len(acted) == 1, acted
    (did, go), = acted
    if did is not None:
        assert all(b.candidate().directive_id == did for b in books)


def test_agreement_requires_every_rank_and_the_step():
    books = [DirectiveBook() for _ in range(4)]
    for b in books[:3]:
        b.offer(_d("x", at=12))
    assert all(d is None for d, _ in _agree(books, 12))      # one rank has not heard yet
    books[3].offer(_d("x", at=12))
    assert all(d is not None and not go for d, go in _agree(books, 11))
    assert all(d is not None and go for d, go in _agree(books, 12))
    assert MAX_EXACT_WORLD >= 16_000


torch = pytest.importorskip("torch")


def _training_state():
    from foreshock.migrator.example import build
    model, opt, sched = build(3000, seed=1)
    for step in range(3):
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state(), "py": random.getstate(), "empty": torch.empty(0, 3),
            "flags": torch.tensor([True, False]), "big": torch.arange(3_000_000, dtype=torch.float64),
            "bf16": torch.ones(5, dtype=torch.bfloat16), "nan": float("nan"), "key": {(1, 2): "t", 3: None}}


def _assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def test_state_round_trips_through_a_real_gloo_pair():
    import torch.distributed as dist
    from foreshock.migrator.transfer import digest, encode, message_plan, recv_state, send_state, tensor_specs
    state = _training_state()
    skeleton, tensors = encode(state)
    plan = message_plan(tensor_specs(skeleton))
    assert any(len(m) > 1 for m in plan) and any(len(m) == 1 for m in plan)    # buckets and singles
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    got, errors = {}, []

    def member(rank):
        try:
            # one store client per member: a client's blocking waits would serialise the two
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
            pg = dist.ProcessGroupGloo(dist.PrefixStore("t/", client), rank, 2, timedelta(seconds=30))
            if rank == 0:
                got["bytes"], got["digest"] = send_state(pg, state, 1, 0)
            else:
                got["state"] = recv_state(pg, 0, 0)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    _assert_same(state, got["state"])
    assert got["bytes"] > 24_000_000
    # the digest the sender reports is the receiver's digest of what it got, and a one-bit change shows
    assert got["digest"] == digest(got["state"]) == digest(state)
    flipped = got["state"]["model"][next(iter(got["state"]["model"]))]
    flipped.view(torch.uint8)[0] ^= 1
    assert digest(got["state"]) != got["digest"]
    flipped.view(torch.uint8)[0] ^= 1
    # and the received optimizer state loads into a fresh optimizer and steps identically
    from foreshock.migrator.example import build
    m1, o1, _ = build(3000, seed=1)
    m1.load_state_dict(state["model"])
    o1.load_state_dict(state["optimizer"])
    m2, o2, _ = build(3000, seed=2)
    m2.load_state_dict(got["state"]["model"])
    o2.load_state_dict(got["state"]["optimizer"])
    x = torch.randn(4, 32)
    for m, o in ((m1, o1), (m2, o2)):
        m.eval()
        m(x).pow(2).mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))


def test_state_without_pickle_refuses_arbitrary_objects():
    from foreshock.migrator.transfer import StateFormatError, encode
    with pytest.raises(StateFormatError, match=r"state\.objects\.loader: object"):
        encode({"objects": {"loader": object()}})


def test_checkpoint_round_trip(tmp_path):
    from foreshock.migrator.transfer import load_checkpoint, save_checkpoint
    state = _training_state()
    save_checkpoint(tmp_path / "c.ckpt", state)
    _assert_same(state, load_checkpoint(tmp_path / "c.ckpt"))
