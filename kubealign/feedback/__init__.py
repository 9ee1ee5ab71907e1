"""Human feedback through Label Studio: pairwise tasks pushed, people's choices pulled back as
preference rows. tasks.py and annotations.py are pure; client.py talks to Label Studio's HTTP API."""
