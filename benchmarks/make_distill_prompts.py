"""Writes benchmarks/distill_prompts.v1.jsonl: the versioned prompt set `specdec distill` uses by
default. Deterministic (templates x subjects, fixed order). None of its prompts is a bench prompt,
so the held-out half of benchmarks/prompts.jsonl measures a draft on text it never saw.

    python benchmarks/make_distill_prompts.py
"""
import json
from pathlib import Path

CODE_TASKS = [
    "reverses a list", "counts the vowels in a string", "finds the largest number in a list",
    "removes duplicates from a list", "checks whether a number is prime", "computes the factorial of n",
    "merges two sorted lists", "returns the n-th Fibonacci number", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit", "validates an email address",
    "sorts a dictionary by its values", "finds the second smallest element", "capitalizes every word",
    "computes the average of a list", "checks whether two strings are anagrams", "reads a text file line by line",
    "finds the greatest common divisor", "generates a random password",
]
CODE_TEMPLATES = [
    "Write a Python function that {task}.",
    "Show me a short JavaScript function that {task}.",
    "How would you write code that {task}? Explain briefly.",
    "Write a Python function that {task}, with a docstring and an example.",
]
CODE_QUESTIONS = [
    "What is a Python list comprehension? Give an example.", "What does the `yield` keyword do in Python?",
    "Explain the difference between a list and a tuple in Python.", "What is recursion in programming?",
    "How do I install a package with pip?", "What is a class in object-oriented programming?",
    "Explain what a hash table is.", "What is the difference between `==` and `is` in Python?",
    "How do I handle exceptions in Python?", "What is a REST API?", "Explain what Git is used for.",
    "What does SQL stand for and what is it used for?", "How do I create a virtual environment in Python?",
    "What is the difference between a compiler and an interpreter?", "Explain Big O notation simply.",
    "What is a for loop? Show an example in Python.", "How do I format a string in Python?",
    "What is JSON and why is it popular?", "Explain what a variable is to a beginner.",
    "How do I sort a list of numbers in descending order in Python?",
]
SUBJECTS = [
    "photosynthesis", "gravity", "the water cycle", "volcanoes", "earthquakes", "the immune system",
    "black holes", "the internet", "electricity", "rainbows", "the seasons", "DNA", "vaccines",
    "inflation", "the stock market", "democracy", "the Roman Empire", "the printing press",
    "renewable energy", "climate change", "the moon's phases", "sleep", "memory", "bees",
    "coral reefs", "the human heart", "machine learning", "blockchain", "solar panels", "recycling",
    "the French Revolution", "the Pyramids of Giza", "glaciers", "hurricanes", "antibiotics",
    "the speed of light", "magnets", "compound interest", "meditation", "the Olympic Games",
]
EXPLAIN_TEMPLATES = [
    "Explain {s} in simple terms.", "What is {s}?", "Give me three interesting facts about {s}.",
    "Why is {s} important?", "Explain {s} to a ten-year-old.", "Write a short paragraph about {s}.",
    "What are the main ideas behind {s}?",
]
CHAT = [
    "How can I get better at waking up early?", "What should I cook for dinner tonight?",
    "Can you recommend a good book for a long flight?", "How do I stay focused while studying?",
    "I have a job interview tomorrow. Any advice?", "What are some fun things to do on a rainy day?",
    "How can I save money on groceries?", "What is a good way to start running?",
    "How do I make new friends in a new city?", "Give me ideas for a birthday gift for my mother.",
    "How can I reduce stress at work?", "What are some healthy breakfast ideas?",
    "How do I keep my houseplants alive?", "Suggest a weekend trip idea.",
    "How can I learn a new language quickly?", "What should I pack for a beach vacation?",
    "How do I write a good thank-you note?", "How can I drink more water during the day?",
    "What is a good routine before going to bed?", "How do I start learning to play guitar?",
    "Tell me a joke about computers.", "Write a short poem about the sea.", "Write a haiku about autumn.",
    "Tell me a short story about a brave cat.", "Write a limerick about a programmer.",
    "Hi! How are you today?", "What can you help me with?", "Give me a motivational quote and explain it.",
    "What are the benefits of reading every day?", "How do I plan a productive week?",
]
TEXTS = [
    "The meeting was moved from Monday to Wednesday because several team members were travelling.",
    "Our new coffee shop opens at seven in the morning and offers fresh pastries baked every day.",
    "Scientists discovered a new species of frog in the rainforest, which is smaller than a coin.",
    "The city council approved a plan to build more bike lanes and plant trees along the main street.",
    "She practiced the piano every evening for a year and finally played in her first concert.",
    "The library will be closed for renovations during the summer and will reopen in September.",
    "Drinking enough water helps the body regulate temperature and keeps the skin healthy.",
    "The team lost the first match but worked hard and won the championship at the end of the season.",
    "Online shopping is convenient, but many people still enjoy visiting local stores.",
    "The museum's new exhibition shows paintings from artists who lived in the nineteenth century.",
]
REWRITE_TEMPLATES = [
    "Summarize this in one sentence: {t}", "Rewrite this more formally: {t}", "Translate to French: {t}",
    "Make this sentence simpler: {t}", "List the key points of this text: {t}", "Write a catchy headline for: {t}",
]


def prompts() -> list[dict]:
    rows = []
    rows += [("code", t.format(task=task)) for t in CODE_TEMPLATES for task in CODE_TASKS]
    rows += [("code", q) for q in CODE_QUESTIONS]
    rows += [("explanation", t.format(s=s)) for s in SUBJECTS for t in EXPLAIN_TEMPLATES]
    rows += [("chat", c) for c in CHAT]
    rows += [("rewrite", t.format(t=text)) for text in TEXTS for t in REWRITE_TEMPLATES]
    return [{"id": f"d{i:04d}", "category": c, "split": "distill", "text": text} for i, (c, text) in enumerate(rows)]


def main() -> None:
    here = Path(__file__).parent
    bench = {json.loads(line)["text"] for line in (here / "prompts.jsonl").read_text().splitlines() if line.strip()}
    rows = prompts()
    assert not bench & {r["text"] for r in rows}, "a distillation prompt is also a bench prompt"
    out = here / "distill_prompts.v1.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts -> {out}")


if __name__ == "__main__":
    main()
