"""A reward module that calls ``sys.exit`` when it is imported (a script turned module)."""

import sys

sys.exit("this module is a script")


def score(**kwargs) -> float:  # never reached
    return 1.0
