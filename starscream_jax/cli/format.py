"""Numbers as the commands print them."""
from ..analysis.memory import format_bytes

__all__ = ["clip", "format_bytes", "format_seconds"]


def format_seconds(value: float) -> str:
    """Seconds as ms below one second ("12.3 ms"), else s ("1.23 s")."""
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def clip(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[: width - 3] + "..."
