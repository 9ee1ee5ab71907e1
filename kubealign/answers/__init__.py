"""A model's answers and their scores: what evaluate, the online judge and the feedback push share."""
