"""`kvlink bench`: the transport measured side by side with its yardsticks."""
