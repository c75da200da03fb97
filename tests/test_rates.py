import pytest

from ratelimits.exceptions import ConfigurationError
from ratelimits.rates import Rate, parse_rate


@pytest.mark.parametrize(
    ("text", "limit", "period_us"),
    [
        ("100/s", 100, 1_000_000),
        ("5/10m", 5, 600_000_000),
        ("1000/h", 1000, 3_600_000_000),
        ("10000/d", 10000, 86_400_000_000),
        ("3/500ms", 3, 500_000),
        ("60/minute", 60, 60_000_000),
        (" 7/2S ", 7, 2_000_000),
    ],
)
def test_valid_rates_parse(text: str, limit: int, period_us: int) -> None:
    assert parse_rate(text) == Rate(limit, period_us)


@pytest.mark.parametrize(
    "text",
    [
        "0/s",
        "-1/m",
        "1e3/s",
        "10/",
        "/s",
        "NaN/s",
        "inf/s",
        "\u0661\u0660\u0660/s",
        "10/\u0665s",
        "10/0s",
        "10/x",
        "1.5/s",
        "10/s/s",
        "",
        "10 / s",
        "99999999999/s",
        "10/999999d",
        "0x10/s",
    ],
)
def test_invalid_rates_name_the_field_and_input(text: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_rate(text, field="TIERS['pro']['rate']")
    assert "TIERS['pro']['rate']" in str(info.value)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("value", [None, 100, 1.5, b"10/s", ["10/s"]])
def test_non_strings_are_rejected(value: object) -> None:
    with pytest.raises(ConfigurationError, match="rate"):
        parse_rate(value)


def test_describe_and_str_round_trip() -> None:
    rate = parse_rate("5/10m")
    assert str(rate) == "5/10m"
    assert rate.describe() == "5 / 10 minutes"
    assert parse_rate("100/s").describe() == "100 / second"
    assert parse_rate(str(rate)) == rate
