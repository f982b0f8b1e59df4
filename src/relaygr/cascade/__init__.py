"""The recommendation cascade around the ranking stage: user histories, retrieval, and the
orchestration of a request's stages and legs (trigger, pre-infer, retrieval, pre-processing,
ranking)."""
