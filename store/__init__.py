"""Durable state: record schemas, key layout, checkpoint store, tool ledger, embedded Redis."""
