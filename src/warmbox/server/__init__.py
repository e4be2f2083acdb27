"""The service side of warmbox: adapters that expose the engine front to remote clients (MCP, HTTP)."""
