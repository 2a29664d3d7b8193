"""The event log of a streamed background response: readers from any sequence number, live and
after the end; the byte bound."""
import asyncio

from services.gateway.http.responses_log import EventLog, LogBudget, replay


def events(*numbers):
    return [{"type": "response.output_text.delta", "sequence_number": n} for n in numbers]


async def collect(stream):
    return "".join([chunk async for chunk in stream])


def test_a_reader_gets_what_was_logged_after_its_start_then_follows_to_the_close():
    async def main():
        log = EventLog(LogBudget(1 << 20))
        log.append(events(0, 1, 2))
        reader = asyncio.create_task(collect(log.follow(after=0)))
        await asyncio.sleep(0)
        log.append(events(3))
        log.close()
        text = await asyncio.wait_for(reader, 5)
        assert [line for line in text.splitlines() if line.startswith("data:")] == \
            [t.splitlines()[1] for t in log.texts[1:]]
        assert await collect(replay(log.texts, after=2)) == log.texts[3]
        assert await collect(replay(log.texts, after=3)) == ""
    asyncio.run(main())


def test_past_its_bound_the_log_keeps_nothing_more_and_readers_stop():
    async def main():
        log = EventLog(LogBudget(1 << 20), max_bytes=300)
        for n in range(10):
            log.append(events(n))
        assert log.full and log.bytes <= 300 and 0 < len(log.texts) < 10
        text = await asyncio.wait_for(collect(log.follow()), 5)   # ends without a close
        assert text == "".join(log.texts)
    asyncio.run(main())


def test_the_running_logs_share_one_budget_and_a_closed_log_gives_its_bytes_back():
    async def main():
        budget = LogBudget(500)
        first, second = EventLog(budget), EventLog(budget)
        for n in range(10):
            first.append(events(n))
        assert first.full and budget.left >= 0
        second.append(events(0))
        assert second.full and not second.texts    # nothing left for it
        first.close()
        assert budget.left == 500
        third = EventLog(budget)
        third.append(events(0))
        assert third.texts and not third.full
    asyncio.run(main())
