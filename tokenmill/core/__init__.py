"""Scheduler-side state: requests, KV bookkeeping, the scheduler/runner contract.

Nothing in this package imports torch; it only moves ids and counters.
"""
