"""The trajectory assembler: joins calls, lifecycle and rewards into token-exact trajectories."""
