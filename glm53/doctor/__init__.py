"""`glm53 doctor`: probe the host, check it against what glm53 needs, and plan a mode with a
predicted speed (the seed's manual setup guide as a command)."""
