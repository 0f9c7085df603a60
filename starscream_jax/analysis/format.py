"""Numbers as the commands print them."""


def format_bytes(count: float) -> str:
    """A byte count with a binary unit: '512 B', '1.5 KiB', '3.2 MiB', '2.0 GiB'."""
    for unit in ("B", "KiB", "MiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def format_seconds(value: float) -> str:
    """Seconds as ms below one second ("12.3 ms"), else s ("1.23 s")."""
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def clip(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in "..." where it was cut."""
    return text if len(text) <= width else text[: width - 3] + "..."
