"""The protocol every phaseline actor shares: phases, events, errors and their wire codec."""
