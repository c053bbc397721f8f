"""eagle-data: EAGLE-3 draft-model training data from a target model, as a Ray Data job."""
