"""A reward module whose import takes 2 s (a user's heavy imports, or a busy machine)."""

import time

time.sleep(2.0)


def ok(prompt, response, ground_truth, data_source, extra_info) -> float:
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
