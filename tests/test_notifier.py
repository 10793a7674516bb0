"""How the notifier says what it has queued: done notices to one producer rank merge into one
``DoneNotices``; nothing moves before an abandon or renewal to the same rank; other ranks,
generations and tokens stay apart; a merge that fails still sends every notice."""

from __future__ import annotations

import pytest
import zmq

from kvxfer.handshake import SideChannelClient
from kvxfer.protocol import (
    MAX_DONE_IDS,
    Abandon,
    Ack,
    DoneNotice,
    DoneNotices,
    LeaseRenew,
    RemoteRank,
    decode_side,
    encode,
)
from kvxfer.topology import ParallelLayout
from kvxfer.transfer.load import Notice
from kvxfer.transfer.notifier import merged

LAYOUT = ParallelLayout(tp_size=1, pp_size=1, num_layers=4, num_kv_heads=4)
P0 = RemoteRank(rank=0, host="127.0.0.1", port=5600, generation=1)
P1 = RemoteRank(rank=1, host="127.0.0.1", port=5601, generation=1)


def done(rid: str, to: RemoteRank = P0, generation: int = 1, token: bytes = b"t") -> Notice:
    return Notice(to, DoneNotice(request_id=rid, engine_id="D", rank=0, layout=LAYOUT, generation=generation,
                                 token=token))


def said(out: list) -> list[tuple[int, str, list[str]]]:
    """(port, message type, request ids) of each message, in order."""
    rows = []
    for r, m in out:
        ids = m.request_ids if isinstance(m, DoneNotices | LeaseRenew) else [m.request_id]
        rows.append((r.port, type(m).__name__, list(ids)))
    return rows


def test_done_notices_to_one_rank_merge_where_the_first_stood() -> None:
    out = merged([done("a"), done("x", to=P1), done("b"), done("c")])
    assert said(out) == [(5600, "DoneNotices", ["a", "b", "c"]), (5601, "DoneNotice", ["x"])]
    m = out[0][1]
    assert isinstance(m, DoneNotices) and (m.engine_id, m.rank, m.layout, m.generation, m.token) == \
        ("D", 0, LAYOUT, 1, b"t")


def test_a_lone_done_notice_is_sent_as_it_is() -> None:
    notices = [done("a"), done("x", to=P1)]
    assert merged(notices) == [(n.rank, n.msg) for n in notices]


def test_nothing_moves_before_an_abandon_or_renewal_to_the_same_rank() -> None:
    abandon = Notice(P0, Abandon(request_id="z", generation=1, reason="r", token=b"t"))
    renew = Notice(P0, LeaseRenew(request_ids=["w"], generation=1, token=b"t"))
    out = merged([done("a"), done("b"), abandon, done("c"), done("x", to=P1), renew, done("d"), done("e"),
                  done("y", to=P1)])
    assert said(out) == [
        (5600, "DoneNotices", ["a", "b"]),
        (5600, "Abandon", ["z"]),
        (5600, "DoneNotice", ["c"]),
        (5601, "DoneNotices", ["x", "y"]),  # another rank's: the renewal to rank 0 does not split them
        (5600, "LeaseRenew", ["w"]),
        (5600, "DoneNotices", ["d", "e"]),
    ]


def test_other_generations_and_tokens_stay_apart() -> None:
    out = merged([done("a"), done("b", generation=2), done("c", token=b"u"), done("d"), done("e", generation=2)])
    assert said(out) == [(5600, "DoneNotices", ["a", "d"]), (5600, "DoneNotices", ["b", "e"]),
                         (5600, "DoneNotice", ["c"])]


def test_a_group_holds_at_most_the_protocol_limit() -> None:
    out = merged([done(f"r{i}") for i in range(MAX_DONE_IDS + 3)])
    assert [len(ids) for _, _, ids in said(out)] == [MAX_DONE_IDS, 3]
    assert [i for _, _, ids in said(out) for i in ids] == [f"r{i}" for i in range(MAX_DONE_IDS + 3)]


def test_a_failed_merge_still_sends_every_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in merging must not stop the notifier: the notices go one by one, and later ones too.
    A real ZMQ ROUTER stands in for the producer's side channel and acknowledges each."""
    import kvxfer.transfer.notifier as notifier_mod

    def broken(notices: list[Notice]) -> list:
        raise RuntimeError("a bug in merging")

    monkeypatch.setattr(notifier_mod, "merged", broken)
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    rank = RemoteRank(rank=0, host="127.0.0.1", port=port, generation=1)
    n = notifier_mod.Notifier(SideChannelClient(5.0, 0), 0)
    got: list[str] = []
    try:
        for rid in ("a", "b", "c"):
            n.send(Notice(rank, DoneNotice(request_id=rid, engine_id="D", rank=0, layout=LAYOUT, generation=1)))
        while len(got) < 3:
            assert router.poll(10_000), f"the notifier stopped after {got}"
            ident, empty, frame = router.recv_multipart()
            msg = decode_side(frame)
            assert isinstance(msg, DoneNotice)
            got.append(msg.request_id)
            router.send_multipart([ident, empty, encode(Ack())])
        assert got == ["a", "b", "c"]
    finally:
        n.close()
        router.close()
