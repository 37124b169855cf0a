"""Coalesced (rayrl.coalesce): the calls of one event-loop turn go out as one batch; each caller gets its own answer."""

from __future__ import annotations

import asyncio

from rayrl.coalesce import Coalesced


def test_calls_of_one_turn_go_as_one_batch_and_each_caller_gets_its_own_result():
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        await asyncio.sleep(0.01)
        return [x * 10 for x in items]

    async def go():
        c = Coalesced(send)
        first = await asyncio.gather(*(c(i) for i in range(50)))
        second = await asyncio.gather(c(7), c(8))
        return c, first, second

    c, first, second = asyncio.run(go())
    assert first == [i * 10 for i in range(50)] and second == [70, 80]
    assert sent == [list(range(50)), [7, 8]] and c.batches == 2


def test_an_items_error_reaches_its_caller_alone_and_a_failed_send_reaches_the_whole_batch():
    async def per_item(items: list[int]) -> list:
        return [KeyError(f"no session {x}") if x == 2 else x for x in items]

    async def down(items: list[int]) -> list:
        raise ConnectionError("the actor died")

    async def go():
        one = await asyncio.gather(*(Coalesced(per_item)(i) for i in range(1)), return_exceptions=True)
        c = Coalesced(per_item)
        mixed = await asyncio.gather(*(c(i) for i in range(4)), return_exceptions=True)
        d = Coalesced(down)
        failed = await asyncio.gather(*(d(i) for i in range(3)), return_exceptions=True)
        return one, mixed, failed

    one, mixed, failed = asyncio.run(go())
    assert one == [0]
    assert mixed[:2] == [0, 1] and isinstance(mixed[2], KeyError) and mixed[3] == 3
    assert all(isinstance(e, ConnectionError) for e in failed) and len(failed) == 3


def test_a_caller_that_gives_up_leaves_the_others_their_results_and_max_batch_splits_a_turn():
    sent: list[list[int]] = []

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        await asyncio.sleep(0.05)
        return items

    async def go():
        c = Coalesced(send, max_batch=3)
        calls = [asyncio.wait_for(c(0), 0.01)] + [c(i) for i in range(1, 7)]
        return await asyncio.gather(*calls, return_exceptions=True)

    out = asyncio.run(go())
    assert isinstance(out[0], asyncio.TimeoutError) and out[1:] == [1, 2, 3, 4, 5, 6]
    assert [len(b) for b in sent] == [3, 3, 1] and sorted(sum(sent, [])) == list(range(7))


def test_a_batch_answered_with_the_wrong_number_of_results_fails_its_callers():
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async def go():
        c = Coalesced(short)
        return await asyncio.gather(c(1), c(2), return_exceptions=True)

    out = asyncio.run(go())
    assert all(isinstance(e, RuntimeError) and "1 results for 2 items" in str(e) for e in out)
