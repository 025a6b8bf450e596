"""The write model: a turn's checkpoint saved whole and fenced (the save script's typed call,
its MULTI/EXEC twin, group commit), its content-addressed transcript, and the in-memory
store the bench prices durability against."""
