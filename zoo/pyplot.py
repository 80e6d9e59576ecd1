"""matplotlib.pyplot for the picture writers (zoo.show_attention, training.plot), imported on first
use.

Agg backend (files, no display); a missing matplotlib is an ImportError that says how to get it.
"""

from __future__ import annotations


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("matplotlib is needed to draw pictures: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
