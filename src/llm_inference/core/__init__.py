"""Scheduling and KV block bookkeeping: pure Python, never imports torch."""
