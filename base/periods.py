"""A budget's calendar periods on Redis's clock, in UTC: a day, a week from
Monday, or a month, each numbered from 1970 as ``budget.lua`` numbers them,
so a gateway gives back to the very period it charged, and a report says
when a period ends."""

from datetime import UTC, date, datetime, timedelta
from typing import Literal

Period = Literal["day", "week", "month"]
DAY_MS = 86_400_000
_EPOCH = date(1970, 1, 1)


def index_at(ms: int, period: str) -> int:
    """The index of the period that ``ms`` (epoch ms) falls in."""
    day = ms // DAY_MS
    if period == "day":
        return day
    if period == "week":
        return (day + 3) // 7  # (1970-01-01 was a Thursday)
    on = _EPOCH + timedelta(days=day)
    return on.year * 12 + on.month - 1


def ends_ms(ms: int, period: str) -> int:
    """When the period that ``ms`` falls in ends (epoch ms)."""
    index = index_at(ms, period)
    if period == "day":
        return (index + 1) * DAY_MS
    if period == "week":
        return (index * 7 + 4) * DAY_MS
    year, month = divmod(index + 1, 12)
    start = datetime(year, month + 1, 1, tzinfo=UTC)
    return round(start.timestamp() * 1000)
