"""Checkpoints: what a run saves, how it loads them back, which ones it trusts, where they live, and the exports."""
