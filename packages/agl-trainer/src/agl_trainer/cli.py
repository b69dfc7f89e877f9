"""The ``agl-trainer`` console script."""


def main() -> None:
    print("agl-trainer: not yet implemented")
