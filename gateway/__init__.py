"""The HTTP gateway: authenticates, limits, admits, enqueues and answers each
waiting connection when its reply arrives."""
