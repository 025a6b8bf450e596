"""Running tools: the batch executor under the ledger, the one mapping of a call's end, calls
run in this process, MCP tools and their sessions, the built-in tools."""
