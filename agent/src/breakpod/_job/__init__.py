"""Job coordination: the stall watchdog, the rank board, collectives."""
