"""What the long-running products (the app, the HTTP server, Ray replicas) share of how they treat a hosted session;
torch-free, so a server's options are read before anything heavy loads. (The longest question, for them and for
`stream-qa` alike, is `questions.MAX_QUESTION_CHARS`.)"""

IDLE_CLOSE_S = 600.0  # a hosted session nothing touched for this long is closed (the app's and the server's --idle)
