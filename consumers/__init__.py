"""What reads the streams and reacts: rollout launcher, trajectory assembler, checkpoint publisher."""
