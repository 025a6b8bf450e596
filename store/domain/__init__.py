"""The durable facts beside a turn's record, one store each: the tool ledger, inboxes,
approvals, sessions, the model limiter, host leases, the deployment's ownership, pool sizes,
isolation, side-effect counters, retention and token usage."""
