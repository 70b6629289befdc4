from heron.engine.request import Request
from heron.engine.waiting_queue import WaitingQueue
from heron.sampling_params import SamplingParams


def seq(rid: str, arrival: float, priority: int = 0):
    return Request(rid, None, [1], SamplingParams(max_tokens=1), arrival_time=arrival, priority=priority).seqs[0]


def drain(q: WaitingQueue) -> list[str]:
    out = []
    while len(q):
        out.append(q.pop().request.request_id)
    assert q.first() is None
    return out


def test_fcfs_orders_by_arrival_ties_in_the_order_added_preempted_first():
    q = WaitingQueue("fcfs")
    for rid, t in [("c", 3.0), ("a", 1.0), ("b1", 2.0), ("b2", 2.0)]:
        q.push(seq(rid, t))
    # the scheduler preempts the lowest-ranked running sequence first: the last one pushed goes first
    q.push(seq("p-late", 9.0), preempted=True)
    q.push(seq("p-early", 8.0), preempted=True)
    assert len(q) == 6 and q.first().request.request_id == "p-early"
    assert drain(q) == ["p-early", "p-late", "a", "b1", "b2", "c"]


def test_priority_orders_by_priority_then_arrival_preempted_by_rank():
    q = WaitingQueue("priority")
    q.push(seq("low", 1.0, priority=5))
    q.push(seq("high", 2.0, priority=0))
    q.push(seq("mid", 0.0, priority=2))
    q.push(seq("back", 0.5, priority=2), preempted=True)
    assert drain(q) == ["high", "mid", "back", "low"]


def test_remove_from_anywhere():
    q = WaitingQueue("fcfs")
    seqs = [seq(str(i), float(i)) for i in range(6)]
    for s in seqs:
        q.push(s)
    p = seq("p", 0.0)
    q.push(p, preempted=True)
    for s in (p, seqs[0], seqs[3]):
        q.remove(s)
    assert len(q) == 4 and q.first() is seqs[1]
    assert drain(q) == ["1", "2", "4", "5"]
