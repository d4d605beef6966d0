"""Prometheus text and its HTTP endpoint, for the other packages (the master's ``--metrics-port``): one text
format and one endpoint for every process. Built in ``engram_store._metrics``; this is the door the other
packages use.
"""

from __future__ import annotations

from ._metrics import MetricsEndpoint, gauge, labels

__all__ = ["MetricsEndpoint", "gauge", "labels"]
