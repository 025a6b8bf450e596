"""What the tests share: agents, fake and real servers, helpers (no tests here)."""
