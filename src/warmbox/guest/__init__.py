"""What runs inside a sandbox: the guest agent (PID 1) and the code-context kernel. Stdlib only."""
