"""The gateway's guard/ room: what guards the door: auth, body limits, admission, the sampling rulebook."""
