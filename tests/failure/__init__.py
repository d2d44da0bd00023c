"""Rank, host and server losses: the library names and survives them, the server keeps serving or says why."""
