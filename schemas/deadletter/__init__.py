"""Dead-letter events (records a consumer could not handle). One module per major version."""
